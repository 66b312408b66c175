"""A tiny M3.1-Flash that has learned (issue 27): tasks with checkable answers, their tokenizer, the model config,
rendering into training rows, and the accuracy evaluation (`m3serve eval-tasks`)."""
