"""Experiments behind the command line: each module exposes ``add_arguments(parser)`` and ``run(args) -> int``."""
