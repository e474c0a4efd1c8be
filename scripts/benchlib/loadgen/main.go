// loadgen: the bench's client for what hey and curl cannot do through a proxy.
//
//	loadgen h2 -url URL -n N -c C [-proxy URL] [-cacert FILE]
//	    N GET requests, C at a time, all on one HTTP/2 connection (CONNECT through -proxy, TLS with ALPN h2);
//	    prints {"requests": N, "seconds": S, "errors": E, "proto": "HTTP/2.0"}.
//	loadgen ws -url wss://host/path -n N -size B [-proxy URL] [-cacert FILE] [-header "Name: value"]
//	    one WebSocket (RFC 6455, through CONNECT); sends N binary messages of B bytes one after another, each
//	    waiting for its echo; prints {"messages": N, "seconds": S}.
//	loadgen wsecho -listen ADDR -cert FILE -key FILE
//	    a WebSocket echo server (TLS), for the origin of the WebSocket rows.
//
// Standard library only (Go 1.19): net/http for HTTP/2, a minimal RFC 6455 framing for WebSocket.
package main

import (
	"bufio"
	"crypto/rand"
	"crypto/sha1"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "loadgen: "+format+"\n", args...)
	os.Exit(1)
}

func tlsConfig(cacert, serverName string) *tls.Config {
	config := &tls.Config{ServerName: serverName}
	if cacert != "" {
		pem, err := os.ReadFile(cacert)
		if err != nil {
			fail("%v", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			fail("no certificate in %s", cacert)
		}
		config.RootCAs = pool
	}
	return config
}

type headers []string

func (h *headers) String() string     { return strings.Join(*h, ", ") }
func (h *headers) Set(v string) error { *h = append(*h, v); return nil }

func main() {
	if len(os.Args) < 2 {
		fail("usage: loadgen h2|ws|wsecho ...")
	}
	switch os.Args[1] {
	case "h2":
		runH2(os.Args[2:])
	case "ws":
		runWS(os.Args[2:])
	case "wsecho":
		runEcho(os.Args[2:])
	default:
		fail("unknown mode %s", os.Args[1])
	}
}

func runH2(args []string) {
	flags := flag.NewFlagSet("h2", flag.ExitOnError)
	target := flags.String("url", "", "URL")
	n := flags.Int("n", 1000, "requests")
	c := flags.Int("c", 50, "concurrent streams")
	proxy := flags.String("proxy", "", "proxy URL")
	cacert := flags.String("cacert", "", "CA file")
	flags.Parse(args)
	parsed, err := url.Parse(*target)
	if err != nil {
		fail("%v", err)
	}
	transport := &http.Transport{
		TLSClientConfig:   tlsConfig(*cacert, parsed.Hostname()),
		ForceAttemptHTTP2: true,
		MaxConnsPerHost:   1,
	}
	if *proxy != "" {
		proxyURL, err := url.Parse(*proxy)
		if err != nil {
			fail("%v", err)
		}
		transport.Proxy = http.ProxyURL(proxyURL)
	}
	client := &http.Client{Transport: transport, Timeout: 60 * time.Second}
	// One request first: the connection is open (and HTTP/2) before the clock starts.
	response, err := client.Get(*target)
	if err != nil {
		fail("%v", err)
	}
	io.Copy(io.Discard, response.Body)
	response.Body.Close()
	if response.ProtoMajor != 2 {
		fail("the connection is %s, not HTTP/2", response.Proto)
	}
	var next, errorsSeen int64
	var wait sync.WaitGroup
	started := time.Now()
	for worker := 0; worker < *c; worker++ {
		wait.Add(1)
		go func() {
			defer wait.Done()
			for atomic.AddInt64(&next, 1) <= int64(*n) {
				response, err := client.Get(*target)
				if err != nil {
					atomic.AddInt64(&errorsSeen, 1)
					continue
				}
				io.Copy(io.Discard, response.Body)
				response.Body.Close()
				if response.StatusCode != 200 {
					atomic.AddInt64(&errorsSeen, 1)
				}
			}
		}()
	}
	wait.Wait()
	seconds := time.Since(started).Seconds()
	json.NewEncoder(os.Stdout).Encode(map[string]any{
		"requests": *n, "seconds": seconds, "errors": errorsSeen, "proto": response.Proto,
	})
}

// MARK: - WebSocket

const wsGUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

func accept(key string) string {
	sum := sha1.Sum([]byte(key + wsGUID))
	return base64.StdEncoding.EncodeToString(sum[:])
}

func dialThrough(proxy, address string) (net.Conn, error) {
	if proxy == "" {
		return net.DialTimeout("tcp", address, 10*time.Second)
	}
	proxyURL, err := url.Parse(proxy)
	if err != nil {
		return nil, err
	}
	conn, err := net.DialTimeout("tcp", proxyURL.Host, 10*time.Second)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", address, address)
	reader := bufio.NewReader(conn)
	response, err := http.ReadResponse(reader, &http.Request{Method: "CONNECT"})
	if err != nil {
		return nil, err
	}
	if response.StatusCode != 200 {
		return nil, fmt.Errorf("CONNECT answered %s", response.Status)
	}
	return conn, nil
}

func writeFrame(w io.Writer, opcode byte, payload []byte, mask bool) error {
	header := []byte{0x80 | opcode}
	maskBit := byte(0)
	if mask {
		maskBit = 0x80
	}
	switch {
	case len(payload) < 126:
		header = append(header, maskBit|byte(len(payload)))
	case len(payload) < 65536:
		header = append(header, maskBit|126, byte(len(payload)>>8), byte(len(payload)))
	default:
		header = append(header, maskBit|127)
		header = binary.BigEndian.AppendUint64(header, uint64(len(payload)))
	}
	body := payload
	if mask {
		key := make([]byte, 4)
		rand.Read(key)
		header = append(header, key...)
		body = make([]byte, len(payload))
		for i := range payload {
			body[i] = payload[i] ^ key[i%4]
		}
	}
	if _, err := w.Write(header); err != nil {
		return err
	}
	_, err := w.Write(body)
	return err
}

func readFrame(r *bufio.Reader) (byte, []byte, error) {
	var head [2]byte
	if _, err := io.ReadFull(r, head[:]); err != nil {
		return 0, nil, err
	}
	length := uint64(head[1] & 0x7f)
	switch length {
	case 126:
		var ext [2]byte
		if _, err := io.ReadFull(r, ext[:]); err != nil {
			return 0, nil, err
		}
		length = uint64(binary.BigEndian.Uint16(ext[:]))
	case 127:
		var ext [8]byte
		if _, err := io.ReadFull(r, ext[:]); err != nil {
			return 0, nil, err
		}
		length = binary.BigEndian.Uint64(ext[:])
	}
	var key []byte
	if head[1]&0x80 != 0 {
		key = make([]byte, 4)
		if _, err := io.ReadFull(r, key); err != nil {
			return 0, nil, err
		}
	}
	payload := make([]byte, length)
	if _, err := io.ReadFull(r, payload); err != nil {
		return 0, nil, err
	}
	if key != nil {
		for i := range payload {
			payload[i] ^= key[i%4]
		}
	}
	return head[0] & 0x0f, payload, nil
}

func runWS(args []string) {
	flags := flag.NewFlagSet("ws", flag.ExitOnError)
	target := flags.String("url", "", "wss:// URL")
	n := flags.Int("n", 10000, "messages")
	size := flags.Int("size", 1024, "message size")
	proxy := flags.String("proxy", "", "proxy URL")
	cacert := flags.String("cacert", "", "CA file")
	connectTo := flags.String("connect-to", "", "address to connect to instead of the URL's (direct runs)")
	var extra headers
	flags.Var(&extra, "header", "extra request field")
	flags.Parse(args)
	parsed, err := url.Parse(*target)
	if err != nil || parsed.Scheme != "wss" {
		fail("a wss:// URL is needed")
	}
	address := parsed.Host
	if parsed.Port() == "" {
		address += ":443"
	}
	dialAddress := address
	if *connectTo != "" {
		dialAddress = *connectTo
	}
	raw, err := dialThrough(*proxy, dialAddress)
	if err != nil {
		fail("%v", err)
	}
	conn := tls.Client(raw, tlsConfig(*cacert, parsed.Hostname()))
	keyBytes := make([]byte, 16)
	rand.Read(keyBytes)
	key := base64.StdEncoding.EncodeToString(keyBytes)
	request := fmt.Sprintf("GET %s HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"+
		"Sec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\n", parsed.RequestURI(), parsed.Host, key)
	for _, line := range extra {
		request += line + "\r\n"
	}
	if _, err := io.WriteString(conn, request+"\r\n"); err != nil {
		fail("%v", err)
	}
	reader := bufio.NewReaderSize(conn, 256*1024)
	response, err := http.ReadResponse(reader, &http.Request{Method: "GET"})
	if err != nil {
		fail("%v", err)
	}
	if response.StatusCode != 101 || response.Header.Get("Sec-WebSocket-Accept") != accept(key) {
		fail("the upgrade was answered %s", response.Status)
	}
	message := make([]byte, *size)
	rand.Read(message)
	writer := bufio.NewWriterSize(conn, 256*1024)
	echo := func() {
		if err := writeFrame(writer, 0x2, message, true); err != nil {
			fail("%v", err)
		}
		writer.Flush()
		opcode, payload, err := readFrame(reader)
		if err != nil || opcode != 0x2 || len(payload) != len(message) {
			fail("no echo: %v", err)
		}
	}
	for i := 0; i < 100; i++ {
		echo()
	}
	started := time.Now()
	for i := 0; i < *n; i++ {
		echo()
	}
	seconds := time.Since(started).Seconds()
	writeFrame(writer, 0x8, []byte{0x03, 0xe8}, true)
	writer.Flush()
	json.NewEncoder(os.Stdout).Encode(map[string]any{"messages": *n, "seconds": seconds,
		"authorization": response.Header.Get("X-Authorization")})
}

func runEcho(args []string) {
	flags := flag.NewFlagSet("wsecho", flag.ExitOnError)
	listen := flags.String("listen", "127.0.0.1:0", "address")
	cert := flags.String("cert", "", "certificate")
	keyFile := flags.String("key", "", "key")
	flags.Parse(args)
	pair, err := tls.LoadX509KeyPair(*cert, *keyFile)
	if err != nil {
		fail("%v", err)
	}
	listener, err := tls.Listen("tcp", *listen, &tls.Config{Certificates: []tls.Certificate{pair},
		NextProtos: []string{"http/1.1"}})
	if err != nil {
		fail("%v", err)
	}
	fmt.Println(listener.Addr().String())
	os.Stdout.Sync()
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.EqualFold(r.Header.Get("Upgrade"), "websocket") {
			w.WriteHeader(200)
			return
		}
		hijacker, ok := w.(http.Hijacker)
		if !ok {
			w.WriteHeader(500)
			return
		}
		conn, buffered, err := hijacker.Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		// Whether the upgrade carried a token (the bench checks each target once); never the token itself.
		seen := "absent"
		if strings.HasPrefix(r.Header.Get("Authorization"), "Bearer ") {
			seen = "bearer"
		}
		fmt.Fprintf(buffered, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"+
			"Sec-WebSocket-Accept: %s\r\nX-Authorization: %s\r\n\r\n", accept(r.Header.Get("Sec-WebSocket-Key")), seen)
		buffered.Flush()
		for {
			opcode, payload, err := readFrame(buffered.Reader)
			if err != nil {
				return
			}
			if opcode == 0x8 {
				writeFrame(buffered.Writer, 0x8, payload, false)
				buffered.Flush()
				return
			}
			if err := writeFrame(buffered.Writer, opcode, payload, false); err != nil {
				return
			}
			if buffered.Reader.Buffered() == 0 {
				if err := buffered.Flush(); err != nil && !errors.Is(err, io.EOF) {
					return
				}
			}
		}
	})
	http.Serve(listener, handler)
}
