"""megagrpo.algo"""
