"""The op library: like PopLibs, each op plans a tile mapping, builds vertices and returns its output."""
