package main

import (
	"fmt"

	"github.com/urfave/cli/v2"
)

// Shell completion: the app answers --generate-bash-completion with the
// commands or flags that may follow (urfave/cli's EnableBashCompletion);
// these scripts ask it on each <Tab>.
const bashCompletion = `# berth completion for bash: source <(berth completion bash)
_berth() {
	local cur words
	cur="${COMP_WORDS[COMP_CWORD]}"
	if [[ "$cur" == -* ]]; then
		words=$("${COMP_WORDS[0]}" "${COMP_WORDS[@]:1:$COMP_CWORD-1}" "$cur" --generate-bash-completion 2>/dev/null)
	else
		words=$("${COMP_WORDS[0]}" "${COMP_WORDS[@]:1:$COMP_CWORD-1}" --generate-bash-completion 2>/dev/null)
	fi
	COMPREPLY=($(compgen -W "$words" -- "$cur"))
}
complete -o default -F _berth berth
`

const zshCompletion = `#compdef berth
# berth completion for zsh: source <(berth completion zsh)
_berth() {
	local -a opts
	local cur="${words[-1]}"
	if [[ "$cur" == -* ]]; then
		opts=("${(@f)$(${words[1]} ${words[2,-2]} "$cur" --generate-bash-completion 2>/dev/null)}")
	else
		opts=("${(@f)$(${words[1]} ${words[2,-2]} --generate-bash-completion 2>/dev/null)}")
	fi
	_describe 'berth' opts
}
compdef _berth berth
`

func completionCommand() *cli.Command {
	return &cli.Command{
		Name:      "completion",
		Usage:     "print a shell completion script: source <(berth completion bash)",
		ArgsUsage: "bash|zsh",
		Action: func(c *cli.Context) error {
			switch c.Args().First() {
			case "bash":
				fmt.Fprint(c.App.Writer, bashCompletion)
			case "zsh":
				fmt.Fprint(c.App.Writer, zshCompletion)
			default:
				return fmt.Errorf("completion %q: want bash or zsh", c.Args().First())
			}
			return nil
		},
	}
}
