"""A library that asks one of its operators a question when imported, as torchaudio does
(`torch.ops._torchaudio.cuda_version()`): imported lazily inside a model's constructor (as
transformers imports torchaudio), the call is recorded into the traced construction."""

import torch

LIB = torch.library.Library("aot_test_query", "DEF")
LIB.define("library_version() -> int")
LIB.impl("library_version", lambda: 3, "CompositeExplicitAutograd")

VERSION = torch.ops.aot_test_query.library_version()
