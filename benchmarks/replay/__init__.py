"""Recorded greedy generations replayed through draft proposers, without the model
(``cli.py``: what it shows and how to run it; ``loop.py``: the replay; ``replayers.py``:
the proposers it drives)."""
