"""Defaults more than one stage states, each in one place (no torch import: the command line
reads them to print --help)."""

# DDP's default gradient bucket: the build's --bucket-mb, the passes' default, the planner's reference size
DEFAULT_BUCKET_MB = 25.0
