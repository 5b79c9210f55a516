"""``{"method": "lookahead"}``: Lookahead Decoding's drafts for vLLM's verifier.

``proposer.py`` is the vLLM-facing drafter, a short sequence of steps over the modules
here: ``state.py`` (per-request state), ``feedback.py`` (what a verification pass
tells: acceptance, the Jacobi harvest), ``sources/`` (context match, response corpus,
n-gram pool, draft rescoring), ``trees.py`` (tree candidates and the Jacobi window),
``budget.py`` (what drafts a step affords) and ``options.py``.
"""
