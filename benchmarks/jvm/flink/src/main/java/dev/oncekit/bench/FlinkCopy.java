package dev.oncekit.bench;

import java.util.UUID;
import java.util.concurrent.atomic.AtomicLong;

import org.apache.flink.api.common.JobStatus;
import org.apache.flink.api.common.eventtime.WatermarkStrategy;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.api.java.tuple.Tuple2;
import org.apache.flink.connector.base.DeliveryGuarantee;
import org.apache.flink.connector.kafka.sink.KafkaRecordSerializationSchema;
import org.apache.flink.connector.kafka.sink.KafkaSink;
import org.apache.flink.connector.kafka.source.KafkaSource;
import org.apache.flink.connector.kafka.source.KafkaSourceBuilder;
import org.apache.flink.connector.kafka.source.enumerator.initializer.OffsetsInitializer;
import org.apache.flink.connector.kafka.source.reader.deserializer.KafkaRecordDeserializationSchema;
import org.apache.flink.core.execution.CheckpointingMode;
import org.apache.flink.core.execution.JobClient;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.flink.util.Collector;

/**
 * Flink copying one topic into another, a peer of the kit in make bench (benchmarks/jvm.py runs
 * it), in a local MiniCluster in this JVM:
 *
 * <pre>java -cp ... dev.oncekit.bench.FlinkCopy SERVERS SOURCE TARGET RECORDS GUARANTEE CHECKPOINT_MS PARALLELISM</pre>
 *
 * GUARANTEE is exactly-once or at-least-once (Flink's DeliveryGuarantee). With RECORDS above 0
 * the source is bounded by the topic's end offsets at start (RECORDS is what it holds); the job
 * ends after its final checkpoint has committed the last transaction, and two figures are
 * printed: the seconds from execute() to the job's end, and from the first record read to the
 * job's end (without the MiniCluster's and the job's start-up). With RECORDS 0 the job runs until
 * its standard input ends, printing "ready" once it is running (the latency group produces while
 * it runs).
 */
public final class FlinkCopy {
    /** When the first record was read (System.nanoTime()); the MiniCluster runs in this JVM. */
    static final AtomicLong FIRST_READ = new AtomicLong();

    /** Key and value as they are, stamping the first record's read time. */
    static final class Bytes implements KafkaRecordDeserializationSchema<Tuple2<byte[], byte[]>> {
        @Override
        public void deserialize(ConsumerRecord<byte[], byte[]> record, Collector<Tuple2<byte[], byte[]>> out) {
            if (FIRST_READ.get() == 0) {
                FIRST_READ.compareAndSet(0, System.nanoTime());
            }
            out.collect(Tuple2.of(record.key(), record.value()));
        }

        @Override
        public TypeInformation<Tuple2<byte[], byte[]>> getProducedType() {
            return Types.TUPLE(Types.PRIMITIVE_ARRAY(Types.BYTE), Types.PRIMITIVE_ARRAY(Types.BYTE));
        }
    }

    /** Every record to the target topic, partitioned by key as Kafka's producer does. */
    static final class ToTopic implements KafkaRecordSerializationSchema<Tuple2<byte[], byte[]>> {
        private final String topic;

        ToTopic(String topic) {
            this.topic = topic;
        }

        @Override
        public ProducerRecord<byte[], byte[]> serialize(Tuple2<byte[], byte[]> record, KafkaSinkContext context,
                                                         Long timestamp) {
            return new ProducerRecord<>(topic, record.f0, record.f1);
        }
    }

    public static void main(String[] args) throws Exception {
        String servers = args[0], source = args[1], target = args[2], guarantee = args[4];
        long records = Long.parseLong(args[3]);
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment();
        env.setParallelism(Integer.parseInt(args[6]));
        env.enableCheckpointing(Long.parseLong(args[5]), CheckpointingMode.EXACTLY_ONCE);

        String run = UUID.randomUUID().toString();
        KafkaSourceBuilder<Tuple2<byte[], byte[]>> reader = KafkaSource.<Tuple2<byte[], byte[]>>builder()
                .setBootstrapServers(servers).setTopics(source).setGroupId("bench-flink-" + run)
                .setStartingOffsets(OffsetsInitializer.earliest()).setDeserializer(new Bytes())
                .setProperty("isolation.level", "read_committed");
        if (records > 0) {
            reader.setBounded(OffsetsInitializer.latest());
        }
        KafkaSink<Tuple2<byte[], byte[]>> sink = KafkaSink.<Tuple2<byte[], byte[]>>builder()
                .setBootstrapServers(servers).setRecordSerializer(new ToTopic(target))
                .setDeliveryGuarantee(DeliveryGuarantee.valueOf(guarantee.toUpperCase().replace('-', '_')))
                .setTransactionalIdPrefix("bench-flink-" + run)
                // Flink's default (an hour) is above the broker's transaction.max.timeout.ms (15 minutes).
                .setProperty("transaction.timeout.ms", "600000")
                .build();
        env.fromSource(reader.build(), WatermarkStrategy.noWatermarks(), "kafka").sinkTo(sink);

        if (records > 0) {
            long started = System.nanoTime();
            env.execute("oncekit bench: Flink copy");
            long ended = System.nanoTime();
            System.out.println((ended - started) / 1e9 + " " + (ended - FIRST_READ.get()) / 1e9);
        } else {
            JobClient job = env.executeAsync("oncekit bench: Flink copy");
            while (job.getJobStatus().get() != JobStatus.RUNNING) {
                Thread.sleep(20);
            }
            System.out.println("ready");
            System.out.flush();
            while (System.in.read() != -1) {
                // the caller closes our standard input to stop us
            }
            job.cancel().get();
        }
        System.out.flush();
        System.exit(0);  // the MiniCluster leaves non-daemon threads behind
    }
}
