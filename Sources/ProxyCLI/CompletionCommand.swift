/// `proxyctl completion bash|zsh|fish`: a completion script made from the command table (`ProxyctlCommand.root`),
/// so that every subcommand, flag and fixed value `--help` names completes, and nothing else. The package installs
/// the three scripts where each shell looks for them (docs/packaging.md).
enum CompletionCommand {
    static let shells = ["bash", "zsh", "fish"]

    static let spec = CommandSpec(
        name: "completion",
        abstract: "Print a shell completion script: bash, zsh or fish.",
        discussion: """
            The package installs them; by hand: proxyctl completion bash > \
            ~/.local/share/bash-completion/completions/proxyctl, proxyctl completion zsh > a directory on $fpath \
            as _proxyctl, proxyctl completion fish > ~/.config/fish/completions/proxyctl.fish.
            """,
        arguments: [ArgumentSpec(name: "shell", help: "bash, zsh or fish.", optional: false, values: shells)],
        run: run
    )

    static func run(_ arguments: ParsedArguments, _ context: CommandContext) throws -> Int32 {
        let root = ProxyctlCommand.root
        switch arguments.positionals.first {
        case "bash": context.stdout.write(bash(root))
        case "zsh": context.stdout.write(zsh(root))
        case "fish": context.stdout.write(fish(root))
        default:
            throw UsageError(
                message: "completion expects bash, zsh or fish", command: ["proxyctl", "completion"])
        }
        return ExitCode.success
    }

    // MARK: - The table, flattened

    /// A command and where it is: `[]` for proxyctl itself, `["ca", "init"]`.
    struct Node {
        let path: [String]
        let spec: CommandSpec
        /// Options with --help (and --version for proxyctl itself).
        let options: [OptionSpec]
    }

    static func nodes(_ root: CommandSpec) -> [Node] {
        var found: [Node] = []
        func walk(_ spec: CommandSpec, _ path: [String]) {
            let extra = path.isEmpty ? [ProxyctlCommand.versionOption] : []
            found.append(Node(path: path, spec: spec, options: spec.options + extra + [ArgumentParser.helpOption]))
            for subcommand in spec.subcommands { walk(subcommand, path + [subcommand.name]) }
        }
        walk(root, [])
        return found
    }

    /// `--config` and `-c`.
    static func names(_ option: OptionSpec) -> [String] {
        ["--\(option.name)"] + (option.short.map { ["-\($0)"] } ?? [])
    }

    /// Whether the option's value is a file (`<file>`).
    static func takesFile(_ option: OptionSpec) -> Bool { option.valueName == "file" }

    /// The first sentence of a help text, for the shells that show one line per candidate.
    static func summary(_ help: String) -> String {
        let text = help.split(separator: "\n").joined(separator: " ")
        guard let end = text.firstRange(of: ". ") else { return text.hasSuffix(".") ? String(text.dropLast()) : text }
        return String(text[..<end.lowerBound])
    }

    // MARK: - bash

    static func bash(_ root: CommandSpec) -> String {
        let all = nodes(root)
        var steps = ""
        for node in all where !node.path.isEmpty {
            let parent = node.path.dropLast().joined(separator: " ")
            steps += "            \"\(parent):\(node.path.last!)\") path=\"\(node.path.joined(separator: " "))\" ;;\n"
        }
        var words = ""
        var valued: [String] = []
        var values = ""
        for node in all {
            let path = node.path.joined(separator: " ")
            let candidates =
                node.spec.subcommands.map(\.name) + node.spec.arguments.flatMap(\.values) + node.options.flatMap(names)
            words += "        \"\(path)\") words=\"\(candidates.joined(separator: " "))\" ;;\n"
            for option in node.options where option.valueName != nil {
                let names = names(option)
                valued += names.map { "\(path):\($0)" }
                // The option's value: a file, one of its values, or (a URL, a port) nothing to offer.
                var action = "return"
                if takesFile(option) {
                    action = "mapfile -t COMPREPLY < <(compgen -f -- \"$cur\"); return"
                } else if !option.values.isEmpty {
                    action =
                        "mapfile -t COMPREPLY < <(compgen -W \"\(option.values.joined(separator: " "))\" -- \"$cur\"); return"
                }
                values +=
                    "            " + names.map { "\"\(path):\($0)\"" }.joined(separator: " | ") + ") \(action) ;;\n"
            }
        }
        let valuedPattern = valued.map { "\"\($0)\"" }.joined(separator: " | ")
        return """
            # bash completion for proxyctl (made by `proxyctl completion bash` from its command table)
            _proxyctl() {
                local cur="${COMP_WORDS[COMP_CWORD]}" prev="" path="" word i
                ((COMP_CWORD > 1)) && prev="${COMP_WORDS[COMP_CWORD - 1]}"
                # The subcommand path so far; an option's value is no subcommand. After exec's options (or --)
                # comes the command it runs.
                for ((i = 1; i < COMP_CWORD; i++)); do
                    word="${COMP_WORDS[i]}"
                    if [[ "$path" == exec && ("$word" == -- || "$word" != -*) ]]; then
                        [[ "$word" == -- ]] && ((i++))
                        _proxyctl_command "$i"
                        return
                    fi
                    case "$path:$word" in
            \(steps)            \(valuedPattern)) ((i++)) ;;
                    esac
                done
                case "$path:$prev" in
            \(values)    esac
                if [[ "$path" == exec && "$cur" != -* ]]; then
                    _proxyctl_command "$COMP_CWORD"
                    return
                fi
                local words=""
                case "$path" in
            \(words)    esac
                mapfile -t COMPREPLY < <(compgen -W "$words" -- "$cur")
            }
            # The command of proxyctl exec from word $1 on: as bash-completion completes it, else a command name, then
            # files.
            _proxyctl_command() {
                local cur="${COMP_WORDS[COMP_CWORD]}"
                if declare -F _command_offset >/dev/null; then
                    _command_offset "$1"
                elif (($1 >= COMP_CWORD)); then
                    mapfile -t COMPREPLY < <(compgen -c -- "$cur")
                else
                    mapfile -t COMPREPLY < <(compgen -f -- "$cur")
                fi
            }
            complete -F _proxyctl proxyctl

            """
    }

    // MARK: - zsh

    static func zsh(_ root: CommandSpec) -> String {
        func quoted(_ text: String) -> String {
            "'" + text.replacing("'", with: "'\\''") + "'"
        }
        func description(_ text: String) -> String {
            summary(text).replacing("\\", with: "\\\\").replacing("[", with: "\\[").replacing("]", with: "\\]")
                .replacing(":", with: "\\:")
        }
        func function(_ path: [String]) -> String {
            (["_proxyctl"] + path).joined(separator: "_").replacing("-", with: "_")
        }
        var text =
            "#compdef proxyctl\n# zsh completion for proxyctl (made by `proxyctl completion zsh` from its command table)\n"
        for node in nodes(root).reversed() {
            var specs: [String] = []
            for option in node.options {
                var names = ["--\(option.name)"]
                if let short = option.short { names.insert("-\(short)", at: 0) }
                let exclusion = names.count > 1 ? "(\(names.joined(separator: " ")))" : ""
                var action = ""
                if let valueName = option.valueName {
                    let message = valueName.replacing(":", with: "\\:")
                    if takesFile(option) {
                        action = ":\(message):_files"
                    } else if !option.values.isEmpty {
                        action = ":\(message):(\(option.values.joined(separator: " ")))"
                    } else {
                        action = ":\(message): "
                    }
                }
                let repeated = option.repeatable ? "*" : ""
                let body = "[\(description(option.help))]\(action)"
                if names.count > 1 {
                    specs.append(
                        "\(quoted(exclusion))\(repeated.isEmpty ? "" : "'*'"){\(names.joined(separator: ","))}\(quoted(body))"
                    )
                } else {
                    specs.append(quoted("\(repeated)\(names[0])\(body)"))
                }
            }
            if !node.spec.subcommands.isEmpty {
                specs.append(quoted("1: :->command"))
                specs.append(quoted("*:: :->argument"))
            } else if node.path == ["exec"] {
                specs.append(quoted("1:command:_command_names -e"))
                specs.append(quoted("*::arguments:_normal"))
            } else {
                for (position, argument) in node.spec.arguments.enumerated() {
                    let name = argument.name.replacing(":", with: "\\:")
                    let action = argument.values.isEmpty ? " " : "(\(argument.values.joined(separator: " ")))"
                    specs.append(quoted("\(position + 1):\(argument.optional ? ":" : "")\(name):\(action)"))
                }
            }
            text += "\n\(function(node.path))() {\n"
            if node.spec.subcommands.isEmpty {
                text += "    _arguments -s \\\n        " + specs.joined(separator: " \\\n        ") + "\n"
            } else {
                text += "    local curcontext=\"$curcontext\" state line\n"
                text += "    _arguments -C -s \\\n        " + specs.joined(separator: " \\\n        ") + "\n"
                text += "    case $state in\n    command)\n        local -a commands=(\n"
                for subcommand in node.spec.subcommands {
                    text += "            \(quoted("\(subcommand.name):\(summary(subcommand.abstract))"))\n"
                }
                text += "        )\n        _describe -t commands command commands\n        ;;\n    argument)\n"
                text += "        case ${line[1]} in\n"
                for subcommand in node.spec.subcommands {
                    text += "        \(subcommand.name)) \(function(node.path + [subcommand.name])) ;;\n"
                }
                text += "        esac\n        ;;\n    esac\n"
            }
            text += "}\n"
        }
        text += "\n_proxyctl \"$@\"\n"
        return text
    }

    // MARK: - fish

    static func fish(_ root: CommandSpec) -> String {
        func quoted(_ text: String) -> String {
            "'" + text.replacing("\\", with: "\\\\").replacing("'", with: "\\'") + "'"
        }
        let all = nodes(root)
        var text = """
            # fish completion for proxyctl (made by `proxyctl completion fish` from its command table)
            function __proxyctl_path --description 'The proxyctl subcommands typed so far'
                set -l path
                for word in (commandline -opc)[2..-1]
                    switch "$path:$word"

            """
        for node in all where !node.path.isEmpty {
            let parent = node.path.dropLast().joined(separator: " ")
            text += "        case \(quoted("\(parent):\(node.path.last!)"))\n"
            text += "            set path \(quoted(node.path.joined(separator: " ")))\n"
        }
        text += """
                    end
                end
                echo "$path"
            end
            function __proxyctl_at --description 'Whether the proxyctl subcommands typed so far are these'
                test (__proxyctl_path) = "$argv[1]"
            end
            complete -c proxyctl -f

            """
        for node in all {
            let condition = "-n \(quoted("__proxyctl_at \(quoted(node.path.joined(separator: " ")))"))"
            for subcommand in node.spec.subcommands {
                text +=
                    "complete -c proxyctl \(condition) -a \(quoted(subcommand.name)) -d \(quoted(summary(subcommand.abstract)))\n"
            }
            for argument in node.spec.arguments where !argument.values.isEmpty {
                text += "complete -c proxyctl \(condition) -a \(quoted(argument.values.joined(separator: " ")))\n"
            }
            for option in node.options {
                var line = "complete -c proxyctl \(condition) -l \(option.name)"
                if let short = option.short { line += " -s \(short)" }
                if option.valueName != nil {
                    line += takesFile(option) ? " -r -F" : " -x"
                    if !option.values.isEmpty { line += " -a \(quoted(option.values.joined(separator: " ")))" }
                }
                text += line + " -d \(quoted(summary(option.help)))\n"
            }
        }
        text += "complete -c proxyctl -n \(quoted("__proxyctl_at exec")) -a '(__fish_complete_subcommand)'\n"
        return text
    }
}
