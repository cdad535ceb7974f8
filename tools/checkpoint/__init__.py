"""Checkpoint CLIs (thin argparse wrappers over ``megatron.checkpointing``): HF <-> Trident conversions."""
