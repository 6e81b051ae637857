"""The Sweep tab: a grid of ΔPPL (`tab`), its Tune companion (`tune`) and the best point both keep
for "Send best to Compare" (`best`)."""
