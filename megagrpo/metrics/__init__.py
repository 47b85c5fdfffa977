"""megagrpo.metrics"""
