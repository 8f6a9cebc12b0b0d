"""The conversion wing: ``nn.Module`` -> ``GraphModule`` with explicit casts.

Read in the order a conversion runs: ``convert`` (the entry point; ``lazy`` captures at the first call,
``blocks`` and ``families`` convert in place, per block family) -> ``capture/`` (torch.fx or torch.export)
-> ``classify/`` (one ``Decision`` per node, over ``op_lists``) -> ``rewrite/`` (storage dtypes, casts,
float8, attention, islands, overflow checks, checkpoints) -> ``runtime/`` (what the generated code calls).
``pipeline.PASSES`` lists the classify and rewrite passes in order; ``graph`` and ``passes`` are the
contract between them.  Nothing here imports the training wing.
"""
