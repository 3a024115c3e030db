"""Ready-made hooks for configs (`hooks.rollout_reward_fn = "harnessrl.recipes.shaping:..."`)."""
