"""megagrpo.curriculum"""
