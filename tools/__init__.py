"""Command-line tools (thin argparse CLIs over ``megatron``): preprocessing, merging, tokenizer training."""
