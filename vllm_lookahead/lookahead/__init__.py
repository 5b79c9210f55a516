"""``{"method": "lookahead"}``: Lookahead Decoding's drafts for vLLM's verifier.

``proposer.py`` is the vLLM-facing drafter, a short sequence of steps over the modules
here, layer by layer (each imports only from the layers below it):
``learning.py`` (reading a verification pass) and ``planning.py`` (a step's drafts);
below them ``feedback.py`` (what a pass tells: acceptance, the Jacobi harvest),
``cut.py`` (the cost-aware cut), ``trees.py`` (tree candidates and the Jacobi window),
``tree_switch.py`` (whether trees are on), ``uniform_drafts.py`` (drafts filled to K);
then ``state.py`` (per-request state); then ``sources/`` (context match, response
corpus, n-gram pool, draft rescoring, recycled top-k; ``sources/draft.py``: the
``Draft`` they produce) and ``budget.py`` (what drafts a step affords); at the bottom
``step_cost.py``, ``calibration.py``, ``hindsight.py`` and ``options.py``.
"""
