"""Baselines that select cached tokens per decode step (LongCache, Quest, InfLLM, ArkVale,
PQCache, ...). Each policy lives in its own module; this module collects their registry lines.
"""
from __future__ import annotations

REGISTRY: dict = {}
