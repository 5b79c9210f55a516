"""Where a main draft comes from, one module per source: the request's own context
(``context.py``), other requests' responses, finished or being generated
(``corpus.py``), the request's n-gram pool
(``pool.py``), re-ranked by the target's Jacobi lattice (``rescoring.py``), the target's
recycled top-k (``recycled.py``).

A draft starts with the longest of the context's and the corpus's matches and is filled
by chained pool lookups, then recycled tokens, while its probability estimate stays at
or above ``draft_min_prob``. ``draft.Draft`` names where each of its tokens came from,
by the source names the metrics use; ``drafts.DraftSources`` builds a step's drafts.
"""

