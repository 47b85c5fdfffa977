"""megagrpo.trainer"""
