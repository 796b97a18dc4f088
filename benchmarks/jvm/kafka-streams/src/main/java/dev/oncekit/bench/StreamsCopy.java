package dev.oncekit.bench;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.Properties;
import java.util.UUID;
import java.util.concurrent.atomic.AtomicLong;

import org.apache.kafka.common.serialization.Serdes;
import org.apache.kafka.streams.KafkaStreams;
import org.apache.kafka.streams.StreamsBuilder;
import org.apache.kafka.streams.StreamsConfig;
import org.apache.kafka.streams.kstream.Consumed;
import org.apache.kafka.streams.kstream.Produced;

/**
 * Kafka Streams copying one topic into another, a peer of the kit in make bench
 * (benchmarks/jvm.py runs it):
 *
 * <pre>java -cp ... dev.oncekit.bench.StreamsCopy SERVERS SOURCE TARGET RECORDS GUARANTEE COMMIT_MS THREADS</pre>
 *
 * GUARANTEE is exactly_once_v2 or at_least_once. With RECORDS above 0 it copies that many records,
 * closes (a clean close commits what was processed) and prints the seconds from start() to the end
 * of close(). With RECORDS 0 it runs until its standard input ends, printing "ready" once running
 * (the latency group produces while it runs).
 */
public final class StreamsCopy {
    public static void main(String[] args) throws Exception {
        String servers = args[0], source = args[1], target = args[2], guarantee = args[4];
        long records = Long.parseLong(args[3]);
        Path state = Files.createTempDirectory("oncekit-bench-streams");
        Properties props = new Properties();
        props.put(StreamsConfig.APPLICATION_ID_CONFIG, "bench-streams-" + UUID.randomUUID());
        props.put(StreamsConfig.BOOTSTRAP_SERVERS_CONFIG, servers);
        props.put(StreamsConfig.PROCESSING_GUARANTEE_CONFIG, guarantee);
        props.put(StreamsConfig.COMMIT_INTERVAL_MS_CONFIG, args[5]);
        props.put(StreamsConfig.NUM_STREAM_THREADS_CONFIG, args[6]);
        props.put(StreamsConfig.STATE_DIR_CONFIG, state.toString());
        props.put(StreamsConfig.consumerPrefix("auto.offset.reset"), "earliest");

        AtomicLong copied = new AtomicLong();
        StreamsBuilder builder = new StreamsBuilder();
        builder.stream(source, Consumed.with(Serdes.ByteArray(), Serdes.ByteArray()))
                .peek((key, value) -> copied.incrementAndGet())
                .to(target, Produced.with(Serdes.ByteArray(), Serdes.ByteArray()));

        try (KafkaStreams streams = new KafkaStreams(builder.build(), props)) {
            long started = System.nanoTime();
            streams.start();
            if (records > 0) {
                // Polled every 5 ms: a tenth of Kafka Streams' own commit interval at its fastest.
                while (copied.get() < records) {
                    if (streams.state().hasCompletedShutdown()) {
                        throw new IllegalStateException("Kafka Streams stopped: " + streams.state());
                    }
                    Thread.sleep(5);
                }
                streams.close(Duration.ofMinutes(2));
                System.out.println((System.nanoTime() - started) / 1e9);
            } else {
                while (streams.state() != KafkaStreams.State.RUNNING) {
                    Thread.sleep(20);
                }
                System.out.println("ready");
                System.out.flush();
                while (System.in.read() != -1) {
                    // the caller closes our standard input to stop us
                }
                streams.close(Duration.ofMinutes(2));
            }
        }
    }
}
