"""Drafter families: one module per family (``eagle3_llama``, ``eagle3_mla``, ``dflash``, ``dspark``), the interface
they supply (``family.DrafterFamily``) and the table that registers them (``registry.FAMILIES``).

A family's module supplies its config keys, the drafter it builds from the target's config, its training
objective, its proposer for decoding, its export forms and their loader, its pre-flight verdicts and its size and
step memory; its model code stays in ``model/`` (and its objective and proposer in ``training/`` and
``speculative/``), which the module imports. Siblings extend each other as their models do: both EAGLE-3 families
are ``eagle3.Eagle3Family``, DSpark's is DFlash's.
"""
