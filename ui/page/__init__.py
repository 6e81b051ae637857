"""What every tab of the page shares: the model runner (`runner`, `stop_signal`), the server's doors
(`server`, `checked`, `notice`), the look (`theme`, `render`, `charts`), the controls (`controls`,
`text_inputs`), corpus jobs' estimates (`scoring`), DeepConf's η (`deepconf`), exported files
(`exports`), Compare's settings table (`settings`, which History's exports and the Sweep's "Send
best to Compare" read too), this browser's run history (`history`: Compare records runs, History
lists them) and what a tab hands to Compare (`handoff`). The tabs import only this package (and the
library), never each other (`.importlinter`)."""
