"""Plans computed from the config and the run plan alone, before (or without) any process group: the memory plan
per stage, the MoE plan, FLOPs per token and the bytes each collective moves. Knows no training loop."""
