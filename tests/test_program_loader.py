"""The runner's fast program loader against torch's own deserializer: bit-identical steps."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.commands import EXAMPLES, aot, ok
from runner.format.artifact import Artifact
from runner.execution.init_program import initial_state
from runner.execution.graph_loader import load_graph_module
from runner.format.program import decode_program


@pytest.mark.parametrize("model", ["mlp.py", "gpt.py"])
def test_fast_loader_matches_torch_export_deserializer(model, tmp_path):
    out = tmp_path / "art"
    ok(aot("build", EXAMPLES / model, "--batch-size", "4", "-o", out, "--quiet", "--no-onnx"))
    artifact = Artifact(out)
    program = artifact.program("train")
    data = artifact.read(program["file"])
    fast = load_graph_module(data)
    assert fast is not None, "the fast path should cover aot's own programs"
    reference = decode_program(data, None).module()

    weights, optimizer = initial_state(artifact, artifact.rank(0)["coords"])
    example = artifact.tensors(artifact.manifest["data"]["example"])
    lr = torch.tensor(artifact.manifest["schedule"]["lr"][0][0], dtype=torch.float64)

    def arguments():
        args = []
        for slot in program["inputs"]:
            kind = slot["kind"]
            if kind in ("param", "buffer"):
                args.append(weights[slot["name"]].clone())
            elif kind == "optim":
                args.append(optimizer[f"{slot['name']}:{slot['key']}"].clone())
            elif kind == "lr":
                args.append(lr.clone())
            elif kind == "input":
                args.append(example["inputs"][:4])
            else:
                args.append(example["targets"][:4])
        return args

    a, b = arguments(), arguments()
    for _ in range(3):
        out_a, out_b = fast(*a), reference(*b)
        assert all(torch.equal(x, y) for x, y in zip(out_a, out_b))
    # the in-place updates (weights and optimizer state) agree bit for bit too
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_fast_loader_declines_what_it_does_not_cover():
    assert load_graph_module(b"{}") is None
    program = {"graph_module": {"signature": {"input_specs": [{"parameter": {}}], "output_specs": []}, "graph": {}}}
    assert load_graph_module(json.dumps(program).encode()) is None


def test_fast_loader_holds_an_init_programs_lifted_constants(built):
    """transformers' GPT-2 makes tensors from Python data while it initializes (torch.tensor(...)),
    which export lifts out of the init program into its constants file. The fast path holds them
    as the module's attributes (it took torch's deserializer, seconds of a cold start, before):
    the same weights, bit for bit, from the same seed."""
    from helpers.commands import MODELS

    artifact = Artifact(built(MODELS / "hf_gpt2.py", "--world-size", 1, "--batch-size", 4, "--no-onnx"))
    init = artifact.manifest["init"]
    program, constants = artifact.read(init["file"]), artifact.read(init["constants"])
    assert any("user_input" not in spec for spec in json.loads(program)["graph_module"]["signature"]["input_specs"])
    fast = load_graph_module(program, torch.device("cpu"), constants)
    assert fast is not None
    reference = decode_program(program, constants).module()
    torch.manual_seed(0)
    ours = fast()
    torch.manual_seed(0)
    theirs = reference()
    assert len(ours) == len(theirs) == len(init["outputs"])
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert load_graph_module(program, torch.device("cpu")) is None  # without its constants it declines
