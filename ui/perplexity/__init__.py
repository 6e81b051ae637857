"""The Perplexity tab: ΔPPL on a text (`tab`) and its Recall section (`recall`)."""
