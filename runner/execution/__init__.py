"""Running an artifact: its programs loaded, process groups and data bound, the init program
replayed, the training loop's Trainer, inference, memory tracking and profiling. Reads the format
and the hardware checks; never the command line's rendering."""
