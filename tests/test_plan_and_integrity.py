"""Small pure pieces: the mesh type and the all-or-nothing folder writer."""

from __future__ import annotations

import json

import pytest

from aot.plan.mesh import Mesh
from runner.errors import AotError
from runner.format.integrity import StagedDir, read_verified


def test_mesh_default_is_data_parallel_over_all_ranks():
    mesh = Mesh.parse(None, 8)
    assert mesh.axes == ("dp",) and mesh.shape == (8,)
    assert mesh.groups("dp") == [list(range(8))]
    assert mesh.coords(5) == {"dp": 5}
    assert Mesh.group_name("dp") == "aot.dp"


def test_mesh_rank_layout_is_row_major():
    mesh = Mesh(("dp", "tp"), (2, 4))  # the layout used once more axes exist
    assert mesh.coords(6) == {"dp": 1, "tp": 2}
    assert mesh.rank_of({"dp": 1, "tp": 2}) == 6
    assert mesh.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize(
    "strategy,world,message",
    [
        ("dp=3", 2, "multiply to 3"),
        ("cp=2", 2, "not supported yet"),
        ("dp", 2, "axis=degree"),
        ("dp=0", 1, "axis=degree"),
        ("dp=1,dp=1", 1, "given twice"),
    ],
)
def test_mesh_rejects_bad_strategies(strategy, world, message):
    with pytest.raises(AotError, match=message):
        Mesh.parse(strategy, world)


def test_staged_dir_commits_all_files_then_the_index(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "FORMAT.md").write_text("kept")
    with StagedDir(dest, "index.json") as out:
        out.write("a/one.bin", b"1")
        out.write("two.bin", b"22")
        out.commit({"files": out.files})
    index = json.loads((dest / "index.json").read_text())
    assert read_verified(dest, "two.bin", index["files"]["two.bin"]) == b"22"
    assert (dest / "FORMAT.md").read_text() == "kept"
    assert not list(dest.glob(".staging-*"))
    # a rebuild drops files the new index no longer lists, and their emptied folders
    with StagedDir(dest, "index.json") as out:
        out.write("two.bin", b"33")
        out.commit({"files": out.files})
    assert not (dest / "a").exists() and (dest / "two.bin").read_bytes() == b"33"


def test_staged_dir_failure_leaves_the_old_folder(tmp_path):
    dest = tmp_path / "out"
    with StagedDir(dest, "index.json") as out:
        out.write("x.bin", b"old")
        out.commit({"files": out.files})
    with pytest.raises(RuntimeError):
        with StagedDir(dest, "index.json") as out:
            out.write("x.bin", b"new")
            raise RuntimeError("build failed")
    assert (dest / "x.bin").read_bytes() == b"old"
    assert not list(dest.glob(".staging-*"))


def test_read_verified_refuses_altered_bytes(tmp_path):
    with StagedDir(tmp_path, "index.json") as out:
        entry = out.write("f.bin", b"payload")
        out.commit({"files": out.files})
    (tmp_path / "f.bin").write_bytes(b"paYload")
    with pytest.raises(AotError, match="sha256 does not match"):
        read_verified(tmp_path, "f.bin", entry)
