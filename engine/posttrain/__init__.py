"""Post-training on the trainer: SFT (sft.py) and GRPO/GSPO (grpo.py: rollouts as a batch
source, the policy objective), with their configs, rewards and policy losses."""
