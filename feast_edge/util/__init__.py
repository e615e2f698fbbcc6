"""Infrastructure every stage uses: atomic file writes, named data files, leading-slice indexing."""
