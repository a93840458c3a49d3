"""Issue 39's search for a regime where rollout/learner drift destabilises GRPO: pilot specs and their summary."""
