/// proxyctl(1) in roff, made from the command table (`proxyctl help --man`), so that the manual names every
/// command, argument and option `--help` names, with the same words. scripts/package installs it.
enum ManualPage {
    static func render(_ root: CommandSpec, version: String) -> String {
        var page = """
            .\\" Made by `proxyctl help --man` from the command table; edit Sources/ProxyCLI, not this file.
            .TH PROXYCTL 1 "" "proxyctl \(version)" "User Commands"
            .SH NAME
            proxyctl \\- \(text(lowercasedFirst(root.abstract.hasSuffix(".") ? String(root.abstract.dropLast()) : root.abstract)))
            .SH SYNOPSIS
            .B proxyctl
            .I subcommand
            .RI [ options ]
            .br
            .B proxyctl \\-\\-version
            .SH DESCRIPTION

            """
        page += paragraphs(root.discussion ?? "")
        page += ".SH OPTIONS\n"
        page += item(ProxyctlCommand.versionOption)
        page += item(.flag("help", short: "h", help: "Show help information, for proxyctl and for every subcommand."))
        page += ".SH COMMANDS\n"
        for subcommand in root.subcommands { page += command(subcommand, path: ["proxyctl", subcommand.name]) }
        page += """
            .SH EXIT STATUS
            0 on success, 1 on a failure (with a message saying what to do), 64 on bad usage.
            .B proxyctl exec
            exits with the command's status (128 + N when signal N ended it).
            .SH ENVIRONMENT
            .TP
            .B PROXYCTL_CONFIG
            The configuration file, when no \\-\\-config is given.
            .TP
            .B PROXYCTL_CONFIG_TEXT
            A whole proxy.conf in one variable (containers).
            .TP
            .BR PROXYCTL_LISTEN ", " PROXYCTL_STATE_DIR ", " PROXYCTL_ADMIN_LISTEN ", ..."
            Single keys of [proxy] (docs/sidecar.md lists them).
            .TP
            .B XDG_CONFIG_HOME
            Where the configuration is looked for: $XDG_CONFIG_HOME/proxyctl/proxy.conf (default ~/.config).
            .TP
            .B XDG_STATE_HOME
            Where tokens, keys and the local CA are kept, unless state_dir says: $XDG_STATE_HOME/proxyctl.
            .TP
            .B BROWSER
            The browser
            .B proxyctl login
            opens (else xdg\\-open).
            .SH FILES
            .TP
            .I ~/.config/proxyctl/proxy.conf
            The configuration; every key is described in /usr/share/doc/proxyctl/examples/proxy.conf.example.
            .TP
            .I /usr/lib/systemd/user/proxyctl.socket\\fR, \\fI/usr/lib/systemd/user/proxyctl.service
            proxyctl for every shell of a user: systemctl \\-\\-user enable \\-\\-now proxyctl.socket.
            .SH SEE ALSO
            The documentation in /usr/share/doc/proxyctl: README.md and docs/ (sign\\-in, protected origins,
            clients, sidecar, security, packaging).

            """
        return page
    }

    /// One command: its usage, what it does, its arguments and options, then its subcommands.
    private static func command(_ spec: CommandSpec, path: [String]) -> String {
        var part = ".SS \(text(ArgumentParser.usage(spec, path: path)))\n"
        part += text(spec.abstract) + "\n"
        if let discussion = spec.discussion { part += ".PP\n" + paragraphs(discussion) }
        for argument in spec.arguments {
            part += ".TP\n.I <\(text(argument.name))>\n\(text(argument.help))\n"
        }
        for option in spec.options { part += item(option) }
        for subcommand in spec.subcommands { part += command(subcommand, path: path + [subcommand.name]) }
        return part
    }

    /// An option as a tagged paragraph: `-c, --config <file>`, then its help.
    private static func item(_ option: OptionSpec) -> String {
        var tag = option.short.map { "\\fB\\-\($0)\\fR, " } ?? ""
        tag += "\\fB\\-\\-\(text(option.name))\\fR"
        if let valueName = option.valueName { tag += " \\fI<\(text(valueName))>\\fR" }
        if option.repeatable { tag += " ..." }
        return ".TP\n\(tag)\n\(text(option.help))\n"
    }

    /// Help text as roff paragraphs (a line break in the table's text starts a new one).
    private static func paragraphs(_ discussion: String) -> String {
        discussion.split(separator: "\n").map { text(String($0)) + "\n" }.joined(separator: ".PP\n")
    }

    /// Text for roff: backslashes and hyphens escaped, `code` in bold, no line starting with a control character.
    static func text(_ plain: String) -> String {
        var out = ""
        var bold = false
        for character in plain {
            switch character {
            case "\\": out += "\\e"
            case "-": out += "\\-"
            case "`":
                out += bold ? "\\fR" : "\\fB"
                bold.toggle()
            default: out.append(character)
            }
        }
        if bold { out += "\\fR" }
        if out.hasPrefix(".") || out.hasPrefix("'") { out = "\\&" + out }
        return out
    }

    private static func lowercasedFirst(_ text: String) -> String {
        guard let first = text.first else { return text }
        return first.lowercased() + text.dropFirst()
    }
}
