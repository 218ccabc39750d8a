"""shardstream: run and train large language models on hardware too small for them."""

__version__ = "0.1.0"
