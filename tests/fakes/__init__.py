"""Small fakes the suites share, one module per component they stand in
for; each fake says in its docstring what real thing it replaces."""
