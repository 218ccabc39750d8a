"""`python -m shardstream` runs the `shardstream` command."""

from shardstream.cli import main

main()
