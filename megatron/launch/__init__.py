"""Starting ranks: the local spawner, the rendezvous environment (launchers, Slurm, a bare process), torchrun's
restart rounds (``elastic``), the supervisor that relaunches other launchers (``supervisor``), the device a rank runs
on, the CPU allocator setting, and the process exit codes. Used by training, conversion, generation and the tests
alike; knows no training loop."""
