"""The artifact format and its integrity: the manifest's schema and reader, the mesh axes' names,
shard layouts, program encoding, checkpoints, hashing and signing.

The runner's parts import one way: format <- hardware <- execution <- commands (runner.errors is
everyone's). The format imports nothing else of the runner's (tests/test_layers.py)."""
