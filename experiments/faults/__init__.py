"""The fault cases of the multi-party side (`python -m experiments.fault_cases`): harness.py
runs parties, forge.py builds what a hostile peer sends, kinds.py says how each kind of case
runs, cases.py lists the cases."""
