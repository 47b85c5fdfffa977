"""megagrpo.rewards"""
