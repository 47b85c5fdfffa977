"""megagrpo.rollout"""
