"""The machine the runner is on: topology profiles, probing the live node (NVML, sysfs), checking
it against the artifact's profile, binding ranks to GPUs and NUMA nodes. Reads the format; never
runs a program."""
