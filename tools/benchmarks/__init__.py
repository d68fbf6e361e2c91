"""verl's benchmarks, ``python tools/bench.py <subcommand>``: one module per subcommand
(``rollout``, ``reshard``, ``rl_step``, ``packing``, ``compare_trl``) on a shared ``harness``
(registry, argument helpers, made inputs, machine record, world start, JSON output); ``cli.main``
builds the command line."""
