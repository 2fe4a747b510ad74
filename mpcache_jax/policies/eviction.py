"""Baselines that evict prompt tokens by attention statistics (H2O, TOVA, SnapKV, PrefixKV, ...).

Each policy is a small PromptEvictionPolicy subclass (or AttentionPolicy) in its own module;
this module collects their registry lines.
"""
from __future__ import annotations

REGISTRY: dict = {}
