"""Analysis of what a model does: routing and load diagnostics (`diagnostics`), plotly
figures (`viz`), the ipywidgets explorer (`widgets`), expert-cache simulation
(`cachesim`), and quality statistics (`quality`: KL divergence, top-1, routing flips)."""
