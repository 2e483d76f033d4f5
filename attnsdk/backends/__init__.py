"""One module per backend. Importing a backend module never imports its kernel library."""
