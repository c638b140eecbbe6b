"""Proposers; importing the package registers every method (see registry)."""

from specdec.core.proposers import draft_model, eagle, medusa, ngram  # noqa: F401  (they register themselves)
from specdec.core.proposers.registry import PROPOSERS, Target, build_proposer, require  # noqa: F401
