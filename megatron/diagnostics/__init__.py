"""Diagnostics of the machines a job runs on: cluster checks over sysfs, the collective bandwidth benchmark and the
hang watchdog. Knows no training loop."""
