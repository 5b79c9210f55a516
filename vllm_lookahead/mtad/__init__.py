"""MTAD (Qin et al., ICLR 2025): auxiliary-model beam drafts, joint-probability acceptance.

``proposer.MTADProposer`` is loaded by vLLM's ``custom_class`` path in workers only.
"""
