"""megagrpo.parallel"""
