"""megagrpo.model"""
