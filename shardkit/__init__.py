"""shardkit: HF <-> Megatron-Core distributed checkpoints. The command line lives in shardkit.cli."""
__version__ = "0.1.0"
