"""Memory plans and step-time estimates of cluster placements (the ``--dry-run`` and ``tools/plan.py``)."""
