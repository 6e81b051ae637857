"""Gradio UI for Feedback Lens: HTML rendering and Plotly charts of run records."""
