"""The conversion wing: ``nn.Module`` -> ``GraphModule`` with explicit casts.

Read top to bottom: ``capture/`` (torch.fx or torch.export) -> ``classify`` (one ``Decision`` per
node, over ``op_lists``) -> ``rewrite`` (storage dtypes, casts) -> ``runtime`` (what the generated
code calls); ``pipeline`` runs classify + rewrite on a captured graph, ``convert`` is the entry
point, ``lazy`` captures at the first call.  Nothing here imports the training wing.
"""
