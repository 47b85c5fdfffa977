"""megagrpo.kernels"""
