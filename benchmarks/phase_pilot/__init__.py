"""Issue 47's pilots: the regime stable at zero drift and the dose calibration (seeds 100-199, never used by
the confirmatory runs). docs/paper_claims.md, "The phase diagram: how the regime and the doses were chosen"."""
